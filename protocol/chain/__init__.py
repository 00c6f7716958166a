"""Chain and state: the certified head, fork choice between verified states, serving and pulling state."""
