"""bitps in the training loops people already have: ``environment.connect`` (a client from
torchrun's or bitps-launch's environment), ``huggingface`` (``transformers.Trainer``) and
``lightning`` (a ``Strategy``). Each imports its framework on use only, so none of them is a
requirement of bitps (``pip install bitps[lightning]`` pins Lightning); docs/integrations.md
shows the lines."""
