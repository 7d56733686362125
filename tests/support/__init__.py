"""What the tests plug into the stack: probe loops, tools and envs, scripted test models, config helpers."""
