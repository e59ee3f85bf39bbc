"""Training DFlash drafts by self-distillation (reference §5): `hetero-sd train-draft`."""
