"""The model being trained: loading/saving, tokenizer + chat template, losses, trainers."""
