"""The round: rules and config, matchmaking, claims and plans, the sharded robust reduce, audit, certification."""
