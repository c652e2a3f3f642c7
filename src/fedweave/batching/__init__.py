"""Who trains each round and with how much work: selection and the controller."""
