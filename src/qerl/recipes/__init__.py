"""Recipes: whole runs that chain qerl's steps (`python -m qerl.recipes.tools`: SFT, then GRPO with tools)."""
