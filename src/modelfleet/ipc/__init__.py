"""The seam between a worker's coordinator and its runtime processes: protocol and framing."""
