"""Views: pictures and text reports of networks, trees and plans (they take values and
never compile)."""
