"""What the CLI runs beside serving: the conformance runner, the quality measures, the startup report (and the
fresh process it measures a start in).

Above everything that serves (they load models through the Python API or the runtimes); only the CLI imports them.
"""
