"""Training pipeline for EAGLE-3 heads: self-distillation data, target features, draft vocab,
training-time-test training and acceptance evaluation. Each stage is one module; `pipeline.py`
sequences them and is what `python -m eagle_engine train` runs."""
