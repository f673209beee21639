"""lmspd: a local model service speaking the Responses protocol (LMSP 1.0 and
OpenAI), with Chat Completions and Anthropic Messages over the same core."""

__version__ = "0.1.0"
