"""Tests that drive a real browser (Chromium through its WebDriver)."""
