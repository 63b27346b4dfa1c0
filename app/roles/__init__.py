"""Entry points, one module per ``python -m`` command: parse, build, run, close.

Owns nothing but wiring: ``trainer`` (the controller on replica 0 and the loop every rank
runs), ``generator``, ``reward``, ``local`` (the single-process reference loop), ``launch``
(torchrun around the trainer, the failure's cause last), ``torchrun``, ``stop``. May import
every other package of ``llamarl.app`` and ``llamarl.pipelines``; nothing imports it
(``llamarl.components`` names its modules only as strings).
"""
