"""
The launchers' machinery (pretrain.sh, speedrun.sh and run1000.sh, runcpu.sh; scripts/launch.py is their entry point):

    nodes.py      where this node runs (Volcengine, Slurm, plain torchrun, one machine) and torchrun's arguments
    pipeline.py   the one builder: a launch's settings -> the steps it runs; each launcher is a profile of it
    runner.py     runs the steps (or prints them: --dry-run), the stop signals passed on to the running one
    bootstrap.py  a fresh machine: the venv, Rust, `pip install -e .` (tests/run.sh runs it too)

Standard library only, like the nanochat modules it asks (presets, configurator, usage): the launchers run it with the
system's python3 before anything is installed (tests/architecture/test_layers.py holds that).
"""
