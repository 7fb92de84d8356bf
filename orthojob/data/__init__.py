"""What the stages train on: cases (generated or imported), prompts and demonstrations."""
