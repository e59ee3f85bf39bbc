"""Training DFlash drafts by self-distillation (the target answers, the draft learns its blocks):
`hetero-sd train-draft`."""
