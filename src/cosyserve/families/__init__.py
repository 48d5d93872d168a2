"""One folder per model family: what a family does differently from the shared models and frontends."""
