"""Collectives and process groups: the only layer that talks to ``torch.distributed`` directly."""
