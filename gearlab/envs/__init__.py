"""Environments in which model-written code is executed (see :mod:`gearlab.envs.sandbox`)."""
