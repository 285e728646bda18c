"""The engines: the machinery the commands measure with, at the level of models and arrays."""
