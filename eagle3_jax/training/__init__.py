"""Training EAGLE-3 drafters: data, draft vocabulary, the training-time test, the trainer, regeneration."""
