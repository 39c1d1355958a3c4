"""Small public-domain text excerpts for calibration and evaluation (see README.md)."""
