"""Training loops: optimizer groups, thread choice, the CoMERA and dense trainers."""
