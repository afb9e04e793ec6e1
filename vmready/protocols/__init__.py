"""Wire formats: the agent's ring-buffer line protocol, the QMP client, the transcript format."""
