"""`ftransformers bench`: a serving benchmark client for any OpenAI-compatible server (ours, vLLM, SGLang,
MindIE). It never imports the engine: it speaks HTTP only."""
