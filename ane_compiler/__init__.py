"""Compiling DFlash drafts for the Apple Neural Engine: an fp16-safe rewrite of the draft graph."""
