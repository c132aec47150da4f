"""Small models in the upstream style, each with its `bug` and `fix` variants side by side."""
