"""One module per failure: builds the scenario, runs it, returns tidy results and figures."""
