"""Results tools beside docs/ (not in the wheel): the tables of the results documents (`report`) and the NIAH plots
(`plot_niah`); run from the repository root, e.g. `python -m tools.plot_niah results/niah.json`."""
