"""Orchestration: the steps the verbs run, built from the layers below (calibration, methods, export, eval).

`pipeline` (resolve a calibration, build a plan, the steps compress and compare share), `compress_dryrun`
(`compress --dry-run`'s estimate), `analysis` (`analyze`), `drift` (`analyze --mask-drift`), `summary` (the
result lines the verbs print).
"""
