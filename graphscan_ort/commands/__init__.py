"""The commands that run models, one module each: the path-level entry point over the engines."""
