"""`pdserve plan`: size prefill and decode pools with a discrete-event simulation of the engine's
scheduling and the router's placement, timed by a profile (`pdserve.sim.profile`)."""
