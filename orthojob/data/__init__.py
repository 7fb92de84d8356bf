"""What the stages train on: cases (generated or imported) and demonstrations."""
