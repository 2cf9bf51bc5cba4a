from lmfs.fast.grpo import PipelinedGRPOTrainer
