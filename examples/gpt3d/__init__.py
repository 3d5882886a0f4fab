"""gpt3d: a small GPT trained with tensor, pipeline and data parallelism over torch.distributed."""
