"""Text and audio front end: tokenizer, features, resampling."""
