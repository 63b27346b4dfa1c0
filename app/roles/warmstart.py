"""The supervised warm start of the default policy, alone (``llamarl.app.rl.warmstart``).

    python -m llamarl.app.roles.warmstart --out checkpoints/warmstart
"""

from llamarl.app import cli
from llamarl.app.rl.warmstart import WarmStartConfig, warm_start


def main(argv: list[str] | None = None) -> None:
    (cfg,) = cli.parse(argv, WarmStartConfig, description=__doc__.splitlines()[0],
                       prog="python -m llamarl.app.roles.warmstart")
    warm_start(cfg)


if __name__ == "__main__":
    main()
