"""Head training: data (text, conversations, self-distillation, regeneration, feature stores), the loss terms every
head shares, the locked training config and the Optax trainer; each head's own loss lives with its drafter."""
