"""lmspd: a local model service speaking the Responses protocol (LMSP 1.0 and OpenAI)."""

__version__ = "0.1.0"
