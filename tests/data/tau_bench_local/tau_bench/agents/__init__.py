"""tau-bench's agents: the interface and the tool-calling agent."""
