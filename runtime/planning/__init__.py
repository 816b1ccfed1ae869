"""Planning: the memory model, the budget fit, devices and placement, and the machine."""
