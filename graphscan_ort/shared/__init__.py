"""The shared layer: what every command that runs models needs, one definition each."""
