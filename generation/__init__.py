"""What generate.py needs besides the model: text streaming with stop strings, attention pictures."""
