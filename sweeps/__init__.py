"""Optuna sweeps over dflash run configs: definitions (`space`), one trial (`objective`), storage and
dead-worker handling (`storage`), worker processes (`worker`), the command line (`launch`).

    python -m sweeps.launch loss_variants n_trials=24 workers=4
"""

import experiments  # noqa: F401,E402  (its one-line Ctrl-C while the command is still importing)
