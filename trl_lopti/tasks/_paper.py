"""Where the authors of arXiv 2505.12929 publish their data: their repository (a verl fork) at one commit."""

AUTHORS_REPOSITORY = "zhyang2226/AR-Lopti"
"""The authors' public code and data (GitHub)."""

AUTHORS_COMMIT = "cbeb333376decdfe571fa8613bdebcfcc526628d"
"""The commit whose data the paper loaders were checked against (byte for byte, for the K&K prompts)."""

AUTHORS_DATA_URL = f"https://raw.githubusercontent.com/{AUTHORS_REPOSITORY}/{AUTHORS_COMMIT}"
"""Base URL of the files of [`AUTHORS_REPOSITORY`] at [`AUTHORS_COMMIT`]."""
