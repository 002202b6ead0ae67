"""placeholder, being written"""
from trl import GRPOTrainer


class LoptiGRPOTrainer(GRPOTrainer):
    pass
