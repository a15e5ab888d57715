"""Training: tokenizer, the shared Trainer, and one Accelerate-launched script per stage (pretrain, SFT, reward, DPO, PPO)."""
