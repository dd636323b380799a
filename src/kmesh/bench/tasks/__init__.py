"""kmesh bench tasks: agents' reading of their siblings' messages, scored against ground truth
under each reuse strategy."""
