"""swarmloco: peer-to-peer DiLoCo training.

The installed package is this one name. In a checkout its parts keep their own top-level folders and are mapped in
by pyproject.toml's package-dir: ``swarmloco.protocol`` (protocol/), ``swarmloco.peer`` (peer/) and
``swarmloco.coordinator`` (coordinator/). This folder holds the product's commands: the ``swarmloco`` CLI
dispatcher (:mod:`swarmloco.cli`), the local-swarm launcher (:mod:`swarmloco.swarm`) and the zygote fork server
(:mod:`swarmloco.zygote`). Importing it imports nothing, so ``swarmloco --help`` stays fast; the version is
the installed distribution's (``importlib.metadata.version("swarmloco")``).
"""
