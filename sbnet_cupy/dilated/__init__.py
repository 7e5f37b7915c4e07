"""Dilated (atrous) convolution through space_to_batch / batch_to_space."""
