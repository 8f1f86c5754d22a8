// MathJax 2.7 configuration for pymdownx.arithmatex (generic mode): \( \) inline, \[ \] display.
// MathJax itself is served from the site (vendor/mathjax, copied by docs/hooks.py), not a CDN.
window.MathJax = {
  config: ["TeX-AMS-MML_HTMLorMML-full.js"],
  tex2jax: {
    inlineMath: [["\\(", "\\)"]],
    displayMath: [["\\[", "\\]"]],
    processEscapes: true,
    processEnvironments: true,
    ignoreClass: ".*|",
    processClass: "arithmatex",
  },
  menuSettings: { zoom: "None" },
  showMathMenu: false,
};

// Re-typeset after material's instant navigation swaps the page content.
if (typeof document$ !== "undefined") {
  document$.subscribe(() => {
    if (window.MathJax && MathJax.Hub && MathJax.Hub.Queue) {
      MathJax.Hub.Queue(["Typeset", MathJax.Hub]);
    }
  });
}
