"""Judging planners: held-out evaluation, analysis, plots, the viewer and the reward-signal study."""
