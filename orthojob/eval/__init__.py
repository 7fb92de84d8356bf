"""Judging planners: held-out evaluation, the headline metric, analysis, plots and the viewer."""
