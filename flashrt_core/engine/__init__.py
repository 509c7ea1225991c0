"""What every engine shares, independent of the model: the timing its launch-choice tuning measures with
(`timing`)."""
