"""The package's metadata against what `.ci/run` tests: pure file parsing (setup.cfg, .ci/stacks/, .ci/run).

`.ci/stacks/py3.X-LEG.txt` is one leg of `.ci/run` on Python 3.X: `main` (the stages on the default interpreter),
`newest` (nothing pinned), `minimum` (every floor pinned with ==).
"""

import configparser
import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version


ROOT = Path(__file__).resolve().parents[1]
STACKS = ROOT / ".ci" / "stacks"
LEG_FILE = re.compile(r"py(3\.\d+)-(\w+)\.txt")


def setup_cfg() -> configparser.ConfigParser:
    parser = configparser.ConfigParser()
    parser.read(ROOT / "setup.cfg")
    return parser


def lines(value: str) -> list[str]:
    return [line.strip() for line in value.splitlines() if line.strip() and not line.strip().startswith("#")]


def legs() -> dict[str, str]:
    """{file name: Python version} of every leg."""
    found = {}
    for path in sorted(STACKS.glob("*.txt")):
        match = LEG_FILE.fullmatch(path.name)
        assert match, f"{path.name}: a leg file is named py3.X-LEG.txt"
        found[path.name] = match.group(1)
    return found


def requirements(path: Path) -> dict[str, Requirement]:
    parsed = [Requirement(line) for line in lines(path.read_text())]
    return {requirement.name.lower(): requirement for requirement in parsed}


def floors() -> dict[str, Version]:
    """The `>=` floor of every requirement of install_requires and of the peft extra that has one."""
    config = setup_cfg()
    declared = lines(config["options"]["install_requires"])
    declared += [part.strip() for part in config["options.extras_require"]["peft"].split(";")]
    result = {}
    for requirement in map(Requirement, declared):
        lower = [Version(spec.version) for spec in requirement.specifier if spec.operator == ">="]
        if lower:
            result[requirement.name.lower()] = max(lower)
    return result


def pythons_ci_tests() -> set[str]:
    return set(legs().values())


def classifier_pythons() -> set[str]:
    prefix = "Programming Language :: Python :: "
    classifiers = lines(setup_cfg()["metadata"]["classifiers"])
    return {item[len(prefix) :] for item in classifiers if item.startswith(prefix) and item.count(".") == 1}


def test_the_legs_are_a_main_a_minimum_and_newest_ones():
    kinds = {name: LEG_FILE.fullmatch(name).group(2) for name in legs()}
    assert sorted(set(kinds.values())) == ["main", "minimum", "newest"], kinds
    assert list(kinds.values()).count("main") == 1 and list(kinds.values()).count("minimum") == 1


def test_the_minimum_leg_pins_exactly_the_floors_of_setup_cfg():
    (minimum,) = [name for name in legs() if name.endswith("-minimum.txt")]
    pins = requirements(STACKS / minimum)
    for requirement in pins.values():
        specs = list(requirement.specifier)
        assert len(specs) == 1 and specs[0].operator == "==", f"{minimum}: {requirement} is not an == pin"
    pinned = {name: Version(next(iter(requirement.specifier)).version) for name, requirement in pins.items()}
    assert pinned == floors()


def test_the_minimum_leg_runs_the_oldest_tested_trl_release():
    from trl_lopti import trl_contract  # imports TRL, which every test environment has

    (minimum,) = [name for name in legs() if name.endswith("-minimum.txt")]
    pinned = Version(next(iter(requirements(STACKS / minimum)["trl"].specifier)).version)
    assert pinned == min(map(Version, trl_contract.TESTED_TRL_RELEASES)) == Version(trl_contract.MINIMUM_TRL)


def test_the_minimum_leg_runs_on_the_oldest_admitted_python():
    (minimum,) = [name for name in legs() if name.endswith("-minimum.txt")]
    assert Version(legs()[minimum]) == min(map(Version, pythons_ci_tests()))


def test_the_newest_legs_pin_nothing():
    for name in (name for name in legs() if name.endswith("-newest.txt")):
        assert all(not requirement.specifier for requirement in requirements(STACKS / name).values()), name


def test_the_classifiers_list_exactly_the_tested_pythons():
    assert classifier_pythons() == pythons_ci_tests()


@pytest.mark.parametrize("minor", range(30))
def test_python_requires_admits_the_tested_pythons_and_nothing_else(minor):
    admitted = SpecifierSet(setup_cfg()["options"]["python_requires"])
    version = f"3.{minor}"
    assert (version in admitted) == (version in pythons_ci_tests()), (version, str(admitted))
    assert (f"{version}.5" in admitted) == (version in pythons_ci_tests())  # patch releases alike


def test_ci_run_names_an_interpreter_for_every_leg_but_main():
    script = (ROOT / ".ci" / "run").read_text()
    for name, python in legs().items():
        if not name.endswith("-main.txt"):
            variable = "PYTHON_" + python.replace(".", "_")
            assert f"${{{variable}:=" in script, f".ci/run has no default interpreter ${variable} for {name}"


def test_the_package_says_it_is_typed_and_ships_the_marker():
    config = setup_cfg()
    assert "Typing :: Typed" in lines(config["metadata"]["classifiers"])
    assert "py.typed" in config["options.package_data"]["trl_lopti"]
    assert (ROOT / "trl_lopti" / "py.typed").is_file()


def extras() -> dict[str, list[str]]:
    """{extra: its requirements} of setup.cfg."""
    section = setup_cfg()["options.extras_require"]
    return {name: [part.strip() for part in section[name].split(";") if part.strip()] for name in section}


def test_the_deepspeed_extra_installs_deepspeed_and_the_test_extra_takes_it():
    """The ZeRO launchers need DeepSpeed, which the package does not: `pip install 'trl_lopti[deepspeed]'`; the test
    suite runs them on a CPU (tests/test_launchers.py), so the test extra takes the deepspeed extra, not a copy of it."""
    declared = extras()
    (deepspeed,) = map(Requirement, declared["deepspeed"])
    assert (
        deepspeed.name == "deepspeed"
        and Version("0.19") in deepspeed.specifier
        and Version("0.18.9") not in deepspeed.specifier
    )
    (itself,) = [Requirement(part) for part in declared["test"] if part.startswith("trl_lopti[")]
    assert "deepspeed" in itself.extras and not any(part.startswith("deepspeed") for part in declared["test"])


def test_the_readme_lists_every_extra_and_the_zero_launchers_name_theirs():
    readme = (ROOT / "README.md").read_text()
    listed = re.findall(r"^\| `(\w+)` \|", readme, re.MULTILINE)
    assert listed and sorted(listed) == sorted(extras()), "the README's table of extras is setup.cfg's"
    for launcher in ("zero2", "zero3"):
        header = [
            line
            for line in (ROOT / "configs/accelerate" / f"{launcher}.yaml").read_text().splitlines()
            if line.startswith("#")
        ]
        assert "pip install 'trl_lopti[deepspeed]'" in "\n".join(header), launcher
