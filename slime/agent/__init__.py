"""Agent rollouts: unmodified agent clients talk OpenAI / Anthropic HTTP to `slime.agent.adapters`, which sample from
the engines and hand each turn's token ids to `slime.agent.trajectory`, which turns a session into trainable Samples.
"""
